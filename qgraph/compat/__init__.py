"""The private torch / transformers internals qgraph relies on, and the differences between the
releases it supports, each with its reason.

Every use of a private attribute lives here, so a torch or transformers upgrade breaks in one
place. A difference between supported releases is told by feature detection (does this function,
attribute or argument exist?), never by comparing version strings. ``versions.TESTED`` holds the ranges the
tests ran on (docs/versions.md); ``check_versions`` refuses a release older than a
range's floor and warns about one newer than its top.

The internals are split by library: ``torch_internals`` (hooks, autograd inside custom ops, building
ExportedPrograms, twins, fake tensors, symbolic sizes), ``torch_pipelining`` (what qgraph's stages
across processes need of torch's pipeline stages and schedules) and ``transformers_internals`` (attention and
experts implementations, generation settings, computed buffers, the ViT's inputs, no_grad forwards).
Callers import them from here.
"""
from .torch_internals import (autograd_enabled, export, export_dims, exported_program, fake, fake_call,  # noqa: F401
                              fake_mode, hooked_modules, hooks_set_aside, inductor_symbolic_strides_fix, mark_dynamic,
                              op_argument_names, op_entry, op_schema, own_children, replace_child, shallow_twin,
                              size_expression, size_hint, tracing)
from .transformers_internals import (attn_implementation, attn_implementation_set, computed_buffers,  # noqa: F401
                                     experts_implementation, experts_implementation_run, export_patches,
                                     generation_config, generation_settings, kernels_bound, logits_processors,
                                     run_experts, vision_forward_kwargs, vision_inputs)
from .torch_stored import lazy_graph_module, written  # noqa: F401
from .torch_pipelining import pipeline_stage, pipelining_refusal  # noqa: F401
from .versions import TESTED, check_versions  # noqa: F401
