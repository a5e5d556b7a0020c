"""The tar format (webdataset's convention): the format object (:mod:`.format`, which registers
it), its writer, reader, stream, the numpy layout of a batch's members, and ``index`` of shards
other tools wrote."""

__all__: list[str] = []  # the modules: format (registered), writer, reader, stream
