"""The passes that build a program, and nothing else: ``pipeline.PIPELINE`` lists them in the order
they run, ``base`` has the pass shape, the build context and the runner.

``make`` makes the on-request values a build asks for (by the typed rewrites of ``qgraph.rewrites``),
``decode`` makes a cached decoding step, ``replacement`` the replacement model of an attribution graph,
``edit`` inserts edit slots, ``tap`` makes nodes outputs and drops dead code, ``markers`` strips the
export-time port markers, ``device`` moves recorded devices. Where each value is found
(``values.locate``) and how it is viewed (``kernels.views``) live with the values and the kernels.
"""
