"""Cloud capacity: the autoscaler backend (`klique-agent --backend cloud`) and the providers it starts
instances with. See docs/cloud.md."""
