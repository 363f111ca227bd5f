"""kdn.registry"""
