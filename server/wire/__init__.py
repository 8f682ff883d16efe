"""The wire format: the request and response models (docs/wire-format.md) and how numbers (NaN, ±Inf,
"not measured") travel and are stored."""
