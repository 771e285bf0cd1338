"""The dataset options of the data section's defaults, built as the trainer builds them
(operations/startup.build_options), for tests that build datasets directly."""

from __future__ import annotations

from config.data_config import DataConfig
from operations.startup import build_options

BUILD = build_options(DataConfig())  # data/builder.BuildOptions
SAMPLES = BUILD.samples("train")  # data/gpt_dataset.SampleOptions of a train split
