"""FlowGRPO post-training for Boogu-Image: the loop, rewards, FSDP2, checkpoints and the `trainer` command."""

__version__ = "0.2.0"
