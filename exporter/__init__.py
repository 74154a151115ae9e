"""Offline conversion: checkpoint readers, bucket planning, lowerings, artifact writer."""
