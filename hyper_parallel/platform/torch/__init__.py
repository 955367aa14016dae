"""The PyTorch platform: everything in hyper-parallel that imports torch lives here."""
