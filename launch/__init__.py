"""Training: the top layer, which uses every other package and is used by none.

``model`` is a Llama decoder whose attention is :func:`hdp.attention.dist_attn`. ``runtime`` shards
it with FSDP2 and runs the waves of one step. ``checkpoint`` saves and restores a run. ``train``
is the training loop, and ``pretrain.py`` is the torchrun entry point.
"""
