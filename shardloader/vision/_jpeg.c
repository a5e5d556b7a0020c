/* Crop-aware JPEG decoding with libjpeg(-turbo): decode only the rows and (MCU-aligned) columns
 * a crop box needs, at a DCT scale of num/8.
 *
 * Why C: the two libjpeg-turbo calls that make a crop cheap, jpeg_crop_scanline() (skip the IDCT
 * and colour conversion of columns outside the box) and jpeg_skip_scanlines() (skip them for rows
 * above it; rows below are never read), are in the libjpeg API only, whose error handling needs
 * setjmp/longjmp; no pip-installable wrapper exposes them for libjpeg-turbo 2.x (Debian 12's).
 *
 * This module only decodes: the Python side (shardloader/vision/jpeg.py) draws the box,
 * chooses the scale and falls back to PIL on any error raised here (JpegError), so a file
 * libjpeg rejects or warns about gets PIL's verdict, as on the PIL path.  Untrusted input: every
 * size comes from libjpeg after jpeg_start_decompress() and is checked against the box the caller
 * asked for before a single byte is written; the output buffer is allocated here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

static PyObject *JpegError;

/* Columns decoded beyond each side of the box (see decode()). */
#define MARGIN 8

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int warnings;
    char message[JMSG_LENGTH_MAX];
} ErrorManager;

static void on_error(j_common_ptr cinfo) {
    ErrorManager *err = (ErrorManager *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* Warnings (corrupt data libjpeg can step over) abort too: the caller then asks PIL. */
static void on_message(j_common_ptr cinfo, int level) {
    ErrorManager *err = (ErrorManager *)cinfo->err;
    if (level < 0 && err->warnings++ == 0) {
        (*cinfo->err->format_message)(cinfo, err->message);
    }
}

static void setup(struct jpeg_decompress_struct *cinfo, ErrorManager *err) {
    cinfo->err = jpeg_std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    err->warnings = 0;
    err->message[0] = '\0';
}

/* header(data) -> (width, height, components, colour space name) */
static PyObject *header(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer data;
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    const char *space;
    PyObject *out;

    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    setup(&cinfo, &err);
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        PyBuffer_Release(&data);
        PyErr_SetString(JpegError, err.message);
        return NULL;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
    jpeg_read_header(&cinfo, TRUE);
    switch (cinfo.jpeg_color_space) {
        case JCS_GRAYSCALE: space = "L"; break;
        case JCS_RGB: space = "RGB"; break;
        case JCS_YCbCr: space = "YCbCr"; break;
        case JCS_CMYK: space = "CMYK"; break;
        case JCS_YCCK: space = "YCCK"; break;
        default: space = "unknown";
    }
    out = Py_BuildValue("(IIis)", cinfo.image_width, cinfo.image_height, cinfo.num_components,
                        space);
    jpeg_destroy_decompress(&cinfo);
    PyBuffer_Release(&data);
    return out;
}

/* Copy n RGB pixels, mirrored left-right. */
static void copy_mirrored(unsigned char *dst, const unsigned char *src, size_t n) {
    const unsigned char *s = src + 3 * (n - 1);
    for (size_t i = 0; i < n; i++, dst += 3, s -= 3) {
        dst[0] = s[0];
        dst[1] = s[1];
        dst[2] = s[2];
    }
}

/* decode(data, num, x0, y0, x1, y1, flip) -> bytearray of (y1 - y0) rows of (x1 - x0) RGB
 * pixels: the box [x0, x1) x [y0, y1) of the image decoded at scale num/8 (coordinates in that
 * scale), mirrored left-right if flip (free here: each row is copied out anyway). */
static PyObject *decode(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer data;
    unsigned int num, x0, y0, x1, y1;
    int flip;
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    PyObject *out;
    unsigned char *dst;
    unsigned char *volatile row = NULL;
    size_t out_stride;
    volatile int failed = 0, unsupported = 0;

    if (!PyArg_ParseTuple(args, "y*IIIIIp", &data, &num, &x0, &y0, &x1, &y1, &flip)) return NULL;
    if (num < 1 || num > 16 || x1 <= x0 || y1 <= y0 || x1 - x0 > 65535 || y1 - y0 > 65535) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "bad scale or box");
        return NULL;
    }
    out_stride = (size_t)(x1 - x0) * 3;
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(out_stride * (y1 - y0)));
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    dst = (unsigned char *)PyByteArray_AS_STRING(out);

    Py_BEGIN_ALLOW_THREADS
    setup(&cinfo, &err);
    if (setjmp(err.jump)) {
        failed = 1;
    } else {
        JDIMENSION xoff, width, skip;
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, (const unsigned char *)data.buf, (unsigned long)data.len);
        jpeg_read_header(&cinfo, TRUE);
        if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK ||
            cinfo.data_precision != 8) {
            unsupported = 1;
        } else {
            cinfo.out_color_space = JCS_RGB;
            cinfo.scale_num = num;
            cinfo.scale_denom = 8;
            cinfo.dct_method = JDCT_ISLOW;
            cinfo.do_fancy_upsampling = TRUE;
            jpeg_start_decompress(&cinfo);
            if (x1 > cinfo.output_width || y1 > cinfo.output_height ||
                cinfo.output_components != 3) {
                snprintf(err.message, sizeof err.message,
                         "box (%u, %u, %u, %u) outside the %ux%u scaled image", x0, y0, x1, y1,
                         cinfo.output_width, cinfo.output_height);
                failed = 1;
            } else {
                /* A margin on both sides: fancy upsampling treats the cropped region's first
                 * and last columns as image edges, which would change the box's edge pixels. */
                xoff = x0 > MARGIN ? x0 - MARGIN : 0;
                width = (x1 + MARGIN < cinfo.output_width ? x1 + MARGIN : cinfo.output_width) - xoff;
                if (width < cinfo.output_width) jpeg_crop_scanline(&cinfo, &xoff, &width);
                /* after cropping: output_width == width >= x1 - x0, xoff <= x0 */
                if (xoff > x0 || xoff + width < x1) {
                    snprintf(err.message, sizeof err.message, "crop_scanline gave %u+%u", xoff,
                             width);
                    failed = 1;
                } else {
                    int direct = (!flip && xoff == x0 && width == x1 - x0); /* box at both edges */
                    if (!direct) row = (unsigned char *)malloc((size_t)width * 3);
                    if (!direct && row == NULL) {
                        snprintf(err.message, sizeof err.message, "out of memory");
                        failed = 1;
                    } else {
                        if (y0 > 0) {
                            skip = jpeg_skip_scanlines(&cinfo, y0);
                            if (skip != y0) failed = 1;
                        }
                        while (!failed && cinfo.output_scanline < y1) {
                            unsigned char *target =
                                direct ? dst + (size_t)(cinfo.output_scanline - y0) * out_stride
                                       : row;
                            JSAMPROW rows[1] = {target};
                            unsigned int at = cinfo.output_scanline;
                            if (jpeg_read_scanlines(&cinfo, rows, 1) != 1) {
                                failed = 1;
                                break;
                            }
                            if (flip)
                                copy_mirrored(dst + (size_t)(at - y0) * out_stride,
                                              row + (size_t)(x0 - xoff) * 3, x1 - x0);
                            else if (!direct)
                                memcpy(dst + (size_t)(at - y0) * out_stride,
                                       row + (size_t)(x0 - xoff) * 3, out_stride);
                        }
                        if (!failed && err.warnings) failed = 1;
                    }
                }
            }
        }
    }
    jpeg_destroy_decompress(&cinfo);  /* also after a longjmp; rows below y1 are never decoded */
    free(row);
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&data);
    if (unsupported || failed) {
        Py_DECREF(out);
        if (unsupported)
            PyErr_SetString(JpegError, "colour space or precision not handled here");
        else
            PyErr_SetString(JpegError, err.message[0] ? err.message : "short read");
        return NULL;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"header", header, METH_VARARGS, "(width, height, components, colour space) of a JPEG."},
    {"decode", decode, METH_VARARGS,
     "decode(data, num, x0, y0, x1, y1, flip): RGB bytes of a box of the image at scale num/8."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpeg", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__jpeg(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    JpegError = PyErr_NewException("shardloader.vision._jpeg.JpegError", NULL, NULL);
    if (JpegError == NULL || PyModule_AddObject(m, "JpegError", JpegError) < 0) {
        Py_XDECREF(JpegError);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION_NUMBER",
#ifdef LIBJPEG_TURBO_VERSION_NUMBER
                            LIBJPEG_TURBO_VERSION_NUMBER
#else
                            0
#endif
    );
    return m;
}
