"""Bytes on disk: the CMF container, its dtypes, and the checkpoint readers that feed it."""
