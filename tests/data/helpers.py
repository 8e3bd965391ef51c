"""Shared config builder for the data tests."""

import ml_collections

from configs.data_defaults import data_config


def make_config(**data_overrides) -> ml_collections.ConfigDict:
  """A {"data": ...} config with the data defaults and the given overrides."""
  data = data_config()
  data.update(data_overrides)
  return ml_collections.ConfigDict({"data": data})
