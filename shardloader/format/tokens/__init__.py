"""The token format (token ids end to end, for ``TokenBlocks``): the format object
(:mod:`.format`, which registers it), its layout and its stream."""

__all__: list[str] = []  # the modules: format (registered), writer, reader, stream
