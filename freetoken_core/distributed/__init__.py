"""Tensor parallelism across the devices of one host, on torch.distributed (NCCL on GPUs, gloo on CPU).

The scheduler stays single, in the engine process (rank 0). Each step's plan (`plan.StepPlan`: the
batch's ids, positions, cache slots, page-table rows) is broadcast to the worker processes (ranks
1..n-1, `worker.py`), and every rank runs the same forward over its shard of the weights (heads,
intermediate dimensions, vocabulary; `freetoken_core/parallel.py` and the layers), with one
all-reduce after o_proj and after each MLP. The LM head's logits are gathered on every rank; sampling
happens once, on rank 0. A worker that dies fails the engine's next step with a clear error naming it
(`group.TensorParallelGroup.check`), never a hang: the collectives run with a timeout.
"""
