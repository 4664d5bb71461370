"""Where ZeRO's parameters, gradients and fp32 masters live: buckets and flat buffers."""
