"""The one error type of the converter."""


class ConversionError(ValueError):
  """A checkpoint or config cannot be converted; the message names every offending item."""
