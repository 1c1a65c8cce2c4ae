"""Development tools: the import contracts `make lint` holds, and the fetch of helm and kubectl."""
