"""kdn.edge"""
