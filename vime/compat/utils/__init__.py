"""vllm-project/vime's `vime.utils.*` import paths, for plug-ins written against it.

vllm-project/vime (vLLM's vime, built on slime) keeps its shared helpers under `vime.utils`; its
example plug-ins import `Sample` from `vime.utils.types`, `post` from `vime.utils.http_utils` and
`load_function` from `vime.utils.misc`. Each module here holds those names with the same
meaning, built on vime's own parts; docs/plugin-compat.md lists them. vime's own code does not
import from here.
"""
