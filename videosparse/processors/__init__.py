"""videosparse.processors"""
