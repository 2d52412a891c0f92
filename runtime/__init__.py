"""What runs at step time: ring communication, LSE merge, block kernels, the ring and
dilated algorithms and their custom ops."""
