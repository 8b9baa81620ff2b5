"""KV cache bookkeeping: page pool (free list), radix prefix cache, and the KV page tensors."""
