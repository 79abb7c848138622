"""Kept for the scripts' imports: the finder of the pip packages that ship offline data lives in
``modeling_fwp.packages`` (the installed package needs it for GPT-2's BPE files)."""
from modeling_fwp.packages import locate_data_package

__all__ = ["locate_data_package"]
