"""The model replica: Ray Serve's hooks, the request lifecycle, batcher, decode loop,
inference thread, device health, profiling and the durable-job worker."""
