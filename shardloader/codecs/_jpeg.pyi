# Types of the C extension shardloader/codecs/_jpeg.c (built only where libjpeg-turbo's headers
# and a C compiler are present; shardloader/codecs/jpeg.py imports it).

class JpegError(Exception): ...

LIBJPEG_TURBO_VERSION_NUMBER: int

def header(data: bytes | bytearray | memoryview, /) -> tuple[int, int, int, str]: ...
def decode(
    data: bytes | bytearray | memoryview,
    num: int,
    x0: int,
    y0: int,
    x1: int,
    y1: int,
    flip: bool,
    /,
) -> bytearray: ...
def resize(
    data: bytes | bytearray | memoryview,
    width: int,
    height: int,
    out_width: int,
    out_height: int,
    /,
) -> bytearray: ...
def decode_resize(
    data: bytes | bytearray | memoryview,
    num: int,
    x0: int,
    y0: int,
    x1: int,
    y1: int,
    flip: bool,
    out_width: int,
    out_height: int,
    /,
) -> bytearray: ...
