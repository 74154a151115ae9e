"""pagedgraph: the command line that ties the exporter and the runtime together."""
