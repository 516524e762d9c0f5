"""EAGLE speculative-decoding serving engine: one replica."""
