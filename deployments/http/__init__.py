"""The HTTP side: the ingress deployment, its middleware, its routes, and its clients of the
model replicas."""
