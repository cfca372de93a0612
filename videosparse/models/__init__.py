"""videosparse.models"""
