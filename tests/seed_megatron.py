"""A seed-style plug-in that imports a Megatron module of the seed's, for tests/test_plugin_compat.py."""

from vime.backends.megatron_utils.cp_utils import all_gather_with_cp  # noqa: F401


async def generate(args, sample, sampling_params):
    return sample
