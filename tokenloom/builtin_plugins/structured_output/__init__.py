"""The built-in guided-decoding backends, registered lazily by "module:Class" (this module
imports none of them). Registration order is ``auto``'s order of preference: xgrammar, then
guidance, as vLLM's ``auto`` tries them; outlines and lm-format-enforcer after."""

from tokenloom.plugin_api import hookimpl

_PACKAGE = "tokenloom.builtin_plugins.structured_output"


@hookimpl
def register_structured_output_backends(register):
    register("xgrammar", f"{_PACKAGE}.xgrammar_backend:XGrammarBackend")
    register("guidance", f"{_PACKAGE}.guidance_backend:GuidanceBackend")
    register("outlines", f"{_PACKAGE}.outlines_backend:OutlinesBackend")
    register("lm-format-enforcer", f"{_PACKAGE}.lm_format_enforcer_backend:LMFormatEnforcerBackend")
