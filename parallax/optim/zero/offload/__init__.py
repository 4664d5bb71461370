"""``--offload optimizer``: fp32 masters and optimizer state in host memory, stepped there."""
