"""Parquet schemas, the Boogu chat template and dataset converters for Boogu-Image FlowGRPO."""

__version__ = "0.1.0"
