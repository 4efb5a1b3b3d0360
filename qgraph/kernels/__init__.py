"""The custom ops' kernels, one job per module.

* ``ops``: the ``qgraph::`` custom ops (delta rule, states, packed attention, markers) with their fakes;
* ``delta_states``: the chunked gated delta rule that also returns the state after each token;
* ``native``: the all-token states' C kernel (``states.c``), compiled at first use, for CPU inference;
* ``buffers``: huge-page memory for the big states buffers, and the pool that reuses it;
* ``grad``: the ops' autograd (backwards that recompute the forward), registered by ``import qgraph``.
"""
