"""videosparse.eval"""
