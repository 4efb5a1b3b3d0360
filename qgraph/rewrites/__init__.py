"""The graph rewrites that make a value the exported graph does not hold, each a function of the graph
(what ``passes.make.MakeOnRequest`` applies, in the order a build asks): ``on_request`` names them as
typed data (``Rewrite``: decompose an attention's sdpa, swap a DeltaNet kernel for the state-emitting
one, open a conv's context, split the experts), ``decompose`` and ``swap`` are those rewrites,
``splice`` and ``clt`` splice a dictionary (SAE, transcoder, cross-layer transcoder), and ``emit``
the helpers that emit nodes with the module scope of the node they stand beside. They read the kernels'
ops and nothing of the values or passes above them.
"""
