"""KDN: a knowledge delivery network for model-native data (KV caches, SSM states)."""

__version__ = "0.1.0"
