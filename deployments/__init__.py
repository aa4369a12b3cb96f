"""Ray Serve deployments: ingress, model replica, replica registry, engines."""
