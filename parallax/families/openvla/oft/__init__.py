"""OpenVLA-OFT (``--action-head l1``, ``shared/oft.md``): OpenVLA's model with an L1 head over
action chunks decoded in parallel, a wrist camera and the robot's state; its options, data
side and objective. Importing this package imports none of its modules (``options`` is what
``--help`` reads)."""
