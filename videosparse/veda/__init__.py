"""videosparse.veda"""
