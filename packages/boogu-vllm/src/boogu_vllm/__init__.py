"""Boogu FlowGRPO rollouts in vllm-omni."""
