"""kdn.adapters"""
