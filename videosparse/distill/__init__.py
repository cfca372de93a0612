"""videosparse.distill"""
