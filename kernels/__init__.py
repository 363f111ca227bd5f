"""kdn.kernels"""
