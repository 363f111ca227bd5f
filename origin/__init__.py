"""kdn.origin"""
