"""The engine both LM stages run: the model runner and its CUDA graphs, the forward batch, sampling, and the
tensor-parallel runner/follower over torch.distributed."""
