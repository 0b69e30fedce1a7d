"""The Boogu-Image transformer port, checkpoint loading, prompt/image encoding, rollout engines and the training adapter."""

__version__ = "0.1.0"
