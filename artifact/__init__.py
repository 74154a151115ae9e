"""The on-disk artifact format: what the exporter writes and the runtime reads, so neither imports the other.

`manifest` (manifest.json: model config, bucket families, file checksums), `mindir` (the MINDIR
index and shared weights file) and `settings` (the YAML settings base both configs are built on).
"""
