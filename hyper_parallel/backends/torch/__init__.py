"""PyTorch backend of hyper-parallel (the default): ``TorchBackend`` and the ``torch.distributed.pipelining`` adapter."""
