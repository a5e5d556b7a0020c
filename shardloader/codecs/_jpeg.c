/* Crop-aware JPEG decoding with libjpeg(-turbo): decode only the rows and (MCU-aligned) columns
 * a crop box needs, at a DCT scale of num/8.
 *
 * Why C: the two libjpeg-turbo calls that make a crop cheap, jpeg_crop_scanline() (skip the IDCT
 * and colour conversion of columns outside the box) and jpeg_skip_scanlines() (skip them for rows
 * above it; rows below are never read), are in the libjpeg API only, whose error handling needs
 * setjmp/longjmp; no pip-installable wrapper exposes them for libjpeg-turbo 2.x (Debian 12's).
 *
 * This module only decodes: the Python side (shardloader/codecs/jpeg.py) draws the box,
 * chooses the scale and falls back to PIL on any error raised here (JpegError), so a file
 * libjpeg rejects or warns about gets PIL's verdict, as on the PIL path.  Untrusted input: every
 * size comes from libjpeg after jpeg_start_decompress() and is checked against the box the caller
 * asked for before a single byte is written; the output buffer is allocated here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <setjmp.h>
#include <stdint.h>
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

/* Decode the box [x0, x1) x [y0, y1) of the image at scale num/8 into dst ((y1 - y0) rows of
 * (x1 - x0) RGB pixels), mirrored left-right if flip.  Returns 0, or 1 (failed: message in msg)
 * or 2 (colour space or precision not handled here).  Call without the GIL. */
static int decode_into(const unsigned char *buf, size_t len, unsigned int num, unsigned int x0,
                       unsigned int y0, unsigned int x1, unsigned int y1, int flip,
                       unsigned char *dst, char *msg) {
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    unsigned char *volatile row = NULL;
    size_t out_stride = (size_t)(x1 - x0) * 3;
    volatile int failed = 0, unsupported = 0;

    setup(&cinfo, &err);
    if (setjmp(err.jump)) {
        failed = 1;
    } else {
        JDIMENSION xoff, width, skip;
        jpeg_create_decompress(&cinfo);
        jpeg_mem_src(&cinfo, buf, (unsigned long)len);
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
    if (unsupported) return 2;
    if (failed) {
        snprintf(msg, JMSG_LENGTH_MAX, "%s", err.message[0] ? err.message : "short read");
        return 1;
    }
    return 0;
}

static int check_box(unsigned int num, unsigned int x0, unsigned int y0, unsigned int x1,
                     unsigned int y1) {
    if (num < 1 || num > 16 || x1 <= x0 || y1 <= y0 || x1 - x0 > 65535 || y1 - y0 > 65535) {
        PyErr_SetString(PyExc_ValueError, "bad scale or box");
        return 0;
    }
    return 1;
}

static PyObject *raise_decode(int status, const char *msg) {
    PyErr_SetString(JpegError, status == 2 ? "colour space or precision not handled here" : msg);
    return NULL;
}

/* decode(data, num, x0, y0, x1, y1, flip) -> bytearray of (y1 - y0) rows of (x1 - x0) RGB
 * pixels: the box [x0, x1) x [y0, y1) of the image decoded at scale num/8 (coordinates in that
 * scale), mirrored left-right if flip (free here: each row is copied out anyway). */
static PyObject *decode(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer data;
    unsigned int num, x0, y0, x1, y1;
    int flip, status;
    char msg[JMSG_LENGTH_MAX];
    PyObject *out;
    unsigned char *dst;

    if (!PyArg_ParseTuple(args, "y*IIIIIp", &data, &num, &x0, &y0, &x1, &y1, &flip)) return NULL;
    if (!check_box(num, x0, y0, x1, y1)) {
        PyBuffer_Release(&data);
        return NULL;
    }
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)((size_t)(x1 - x0) * 3 * (y1 - y0)));
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    dst = (unsigned char *)PyByteArray_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    status = decode_into((const unsigned char *)data.buf, (size_t)data.len, num, x0, y0, x1, y1,
                         flip, dst, msg);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (status) {
        Py_DECREF(out);
        return raise_decode(status, msg);
    }
    return out;
}

/* ---------------------------------------------------------------------------------------------
 * Antialiased bilinear resize of RGB pixels: Pillow's filter and pass order (Resample.c: a
 * triangle widened by the reduction factor, coefficients normalised per output pixel, each
 * pass rounded to uint8; the pass that leaves fewer rows first), with 14-bit coefficients so two taps
 * multiply and add in one SSE2 instruction (pmaddwd) as in Pillow-SIMD; within one grey level
 * of Pillow.  Why here and not torch's kernel: one call from the decoded box straight to the
 * planar CHW tensor a batch stacks, without torch's dispatch, its channels-last conversions and
 * a copy to CHW afterwards.  Reads up to 4 bytes past the end of the source: callers pad it. */

#define BITS 14
#define PAD 16 /* bytes a source buffer has beyond its pixels */

typedef struct {
    int taps;      /* coefficients per output pixel, even */
    int *bounds;   /* per output pixel: first input pixel, number of taps used */
    int16_t *k;    /* per output pixel: taps coefficients, zero beyond the used ones */
} Coeffs;

static double triangle(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

static int coeffs(int in_size, int out_size, Coeffs *c) {
    double scale = (double)in_size / out_size;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = filterscale, ss = 1.0 / filterscale;
    int taps = (int)ceil(support) * 2 + 1;
    double *kd;
    taps += taps & 1;
    kd = (double *)malloc(sizeof(double) * taps);
    c->taps = taps;
    c->bounds = (int *)malloc(sizeof(int) * 2 * out_size);
    c->k = (int16_t *)calloc((size_t)taps * out_size, sizeof(int16_t));
    if (kd == NULL || c->bounds == NULL || c->k == NULL) {
        free(kd);
        return 0;
    }
    for (int xx = 0; xx < out_size; xx++) {
        double center = (xx + 0.5) * scale, ww = 0.0;
        int xmin = (int)(center - support + 0.5), xmax = (int)(center + support + 0.5);
        if (xmin < 0) xmin = 0;
        if (xmax > in_size) xmax = in_size;
        xmax -= xmin;
        if (xmax > taps) xmax = taps;
        for (int x = 0; x < xmax; x++) {
            double w = triangle((x + xmin - center + 0.5) * ss);
            kd[x] = w;
            ww += w;
        }
        for (int x = 0; x < xmax; x++) {
            double w = (ww != 0.0 ? kd[x] / ww : kd[x]) * (double)(1 << BITS);
            c->k[(size_t)xx * taps + x] = (int16_t)(w < 0 ? trunc(-0.5 + w) : trunc(0.5 + w));
        }
        c->bounds[2 * xx] = xmin;
        c->bounds[2 * xx + 1] = xmax;
    }
    free(kd);
    return 1;
}

static inline unsigned char clip8(int32_t v) {
    v >>= BITS;
    return v < 0 ? 0 : (v > 255 ? 255 : (unsigned char)v);
}

#ifdef __SSE2__
#include <emmintrin.h>
static inline uint32_t load4(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
#endif

/* One row of RGB pixels -> out_w pixels in each of the three planes p0, p1, p2. */
static void horizontal(const unsigned char *in, unsigned char *p0, unsigned char *p1,
                       unsigned char *p2, int out_w, const Coeffs *c) {
    for (int xx = 0; xx < out_w; xx++) {
        int xmin = c->bounds[2 * xx], n = c->bounds[2 * xx + 1];
        const int16_t *k = c->k + (size_t)xx * c->taps;
        const unsigned char *p = in + (size_t)xmin * 3;
#ifdef __SSE2__
        const __m128i zero = _mm_setzero_si128();
        __m128i acc = _mm_set1_epi32(1 << (BITS - 1));
        for (int x = 0; x < n; x += 2, p += 6) { /* k[n] is 0 when n is odd */
            __m128i a = _mm_unpacklo_epi8(_mm_cvtsi32_si128((int)load4(p)), zero);
            __m128i b = _mm_unpacklo_epi8(_mm_cvtsi32_si128((int)load4(p + 3)), zero);
            int32_t pair;
            memcpy(&pair, k + x, 4);
            acc = _mm_add_epi32(acc, _mm_madd_epi16(_mm_unpacklo_epi16(a, b),
                                                    _mm_set1_epi32(pair)));
        }
        acc = _mm_srai_epi32(acc, BITS);
        acc = _mm_packs_epi32(acc, acc);
        uint32_t rgb = (uint32_t)_mm_cvtsi128_si32(_mm_packus_epi16(acc, acc));
        p0[xx] = (unsigned char)rgb;
        p1[xx] = (unsigned char)(rgb >> 8);
        p2[xx] = (unsigned char)(rgb >> 16);
#else
        int32_t r = 1 << (BITS - 1), g = r, b = r;
        for (int x = 0; x < n; x++, p += 3) {
            r += p[0] * k[x];
            g += p[1] * k[x];
            b += p[2] * k[x];
        }
        p0[xx] = clip8(r);
        p1[xx] = clip8(g);
        p2[xx] = clip8(b);
#endif
    }
}

/* out[0, len) = the n rows (stride apart) weighted by k, rounded to uint8. */
static void vertical(const unsigned char *rows, size_t stride, int n, const int16_t *k,
                     unsigned char *out, size_t len) {
    size_t i = 0;
#ifdef __SSE2__
    const __m128i zero = _mm_setzero_si128();
    for (; i + 8 <= len; i += 8) {
        __m128i lo = _mm_set1_epi32(1 << (BITS - 1)), hi = lo;
        const unsigned char *r = rows + i;
        for (int y = 0; y < n; y += 2, r += 2 * stride) { /* k[n] is 0 when n is odd */
            int32_t pair;
            memcpy(&pair, k + y, 4);
            __m128i kk = _mm_set1_epi32(pair);
            __m128i a = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)r), zero);
            __m128i b = y + 1 < n
                            ? _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(r + stride)), zero)
                            : zero;
            lo = _mm_add_epi32(lo, _mm_madd_epi16(_mm_unpacklo_epi16(a, b), kk));
            hi = _mm_add_epi32(hi, _mm_madd_epi16(_mm_unpackhi_epi16(a, b), kk));
        }
        __m128i v = _mm_packs_epi32(_mm_srai_epi32(lo, BITS), _mm_srai_epi32(hi, BITS));
        _mm_storel_epi64((__m128i *)(out + i), _mm_packus_epi16(v, v));
    }
#endif
    for (; i < len; i++) {
        int32_t acc = 1 << (BITS - 1);
        for (int y = 0; y < n; y++) acc += rows[(size_t)y * stride + i] * k[y];
        out[i] = clip8(acc);
    }
}

/* src: h rows of w RGB pixels (HWC, PAD readable bytes after them) -> dst: planar CHW
 * out_h x out_w.  Returns 0 when out of memory. */
static int resize_into(const unsigned char *src, int w, int h, int out_w, int out_h,
                       unsigned char *dst) {
    Coeffs cx = {0, NULL, NULL}, cy = {0, NULL, NULL};
    unsigned char *mid = NULL;
    size_t plane = (size_t)out_w * out_h, mid_plane = (size_t)out_w * h;
    int ok = 0;

    if (!coeffs(h, out_h, &cy) || !coeffs(w, out_w, &cx)) goto done;
    if (h > out_h) { /* fewer rows first: vertical on the RGB rows, then horizontal to planes */
        size_t stride = (size_t)w * 3;
        mid = (unsigned char *)malloc(stride * out_h + PAD);
        if (mid == NULL) goto done;
        for (int yy = 0; yy < out_h; yy++)
            vertical(src + (size_t)cy.bounds[2 * yy] * stride, stride, cy.bounds[2 * yy + 1],
                     cy.k + (size_t)yy * cy.taps, mid + (size_t)yy * stride, stride);
        for (int yy = 0; yy < out_h; yy++) {
            unsigned char *o = dst + (size_t)yy * out_w;
            horizontal(mid + (size_t)yy * stride, o, o + plane, o + 2 * plane, out_w, &cx);
        }
        ok = 1;
        goto done;
    }
    /* horizontal into three planes of h x out_w, then vertical plane by plane */
    mid = (unsigned char *)malloc(mid_plane * 3 + PAD);
    if (mid == NULL) goto done;
    for (int y = 0; y < h; y++) {
        unsigned char *m = mid + (size_t)y * out_w;
        horizontal(src + (size_t)y * w * 3, m, m + mid_plane, m + 2 * mid_plane, out_w, &cx);
    }
    for (int ch = 0; ch < 3; ch++) {
        for (int yy = 0; yy < out_h; yy++) {
            int ymin = cy.bounds[2 * yy], n = cy.bounds[2 * yy + 1];
            vertical(mid + ch * mid_plane + (size_t)ymin * out_w, (size_t)out_w, n,
                     cy.k + (size_t)yy * cy.taps, dst + ch * plane + (size_t)yy * out_w,
                     (size_t)out_w);
        }
    }
    ok = 1;
done:
    free(cx.bounds);
    free(cx.k);
    free(cy.bounds);
    free(cy.k);
    free(mid);
    return ok;
}

static int check_size(int out_w, int out_h) {
    if (out_w < 1 || out_h < 1 || out_w > 65535 || out_h > 65535) {
        PyErr_SetString(PyExc_ValueError, "bad output size");
        return 0;
    }
    return 1;
}

/* resize(pixels, width, height, out_width, out_height) -> bytearray: planar CHW uint8 of
 * 3 x out_height x out_width, from height rows of width RGB pixels. */
static PyObject *resize(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer data;
    int w, h, out_w, out_h, ok;
    PyObject *out;
    unsigned char *dst;

    if (!PyArg_ParseTuple(args, "y*iiii", &data, &w, &h, &out_w, &out_h)) return NULL;
    if (w < 1 || h < 1 || (Py_ssize_t)w * h * 3 != data.len || !check_size(out_w, out_h)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "pixels are not width x height RGB");
        PyBuffer_Release(&data);
        return NULL;
    }
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)3 * out_w * out_h);
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    dst = (unsigned char *)PyByteArray_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    /* a padded copy: the resize reads a few bytes past the pixels */
    unsigned char *src = (unsigned char *)malloc((size_t)data.len + PAD);
    ok = src != NULL;
    if (ok) {
        memcpy(src, data.buf, (size_t)data.len);
        ok = resize_into(src, w, h, out_w, out_h, dst);
        free(src);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (!ok) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    return out;
}

/* decode_resize(data, num, x0, y0, x1, y1, flip, out_width, out_height) -> bytearray: what
 * decode() gives, resized as resize() does, in one call (planar CHW uint8). */
static PyObject *decode_resize(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer data;
    unsigned int num, x0, y0, x1, y1;
    int flip, out_w, out_h, status = 0;
    char msg[JMSG_LENGTH_MAX];
    PyObject *out;
    unsigned char *dst, *box;

    if (!PyArg_ParseTuple(args, "y*IIIIIpii", &data, &num, &x0, &y0, &x1, &y1, &flip, &out_w,
                          &out_h))
        return NULL;
    if (!check_box(num, x0, y0, x1, y1) || !check_size(out_w, out_h)) {
        PyBuffer_Release(&data);
        return NULL;
    }
    out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)3 * out_w * out_h);
    box = (unsigned char *)malloc((size_t)(x1 - x0) * 3 * (y1 - y0) + PAD);
    if (out == NULL || box == NULL) {
        Py_XDECREF(out);
        free(box);
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    dst = (unsigned char *)PyByteArray_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    status = decode_into((const unsigned char *)data.buf, (size_t)data.len, num, x0, y0, x1, y1,
                         flip, box, msg);
    if (!status && !resize_into(box, (int)(x1 - x0), (int)(y1 - y0), out_w, out_h, dst))
        status = 3;
    Py_END_ALLOW_THREADS
    free(box);
    PyBuffer_Release(&data);
    if (status) {
        Py_DECREF(out);
        return status == 3 ? PyErr_NoMemory() : raise_decode(status, msg);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"header", header, METH_VARARGS, "(width, height, components, colour space) of a JPEG."},
    {"decode", decode, METH_VARARGS,
     "decode(data, num, x0, y0, x1, y1, flip): RGB bytes of a box of the image at scale num/8."},
    {"resize", resize, METH_VARARGS,
     "resize(pixels, w, h, out_w, out_h): antialiased bilinear (Pillow's), planar CHW bytes."},
    {"decode_resize", decode_resize, METH_VARARGS,
     "decode_resize(data, num, x0, y0, x1, y1, flip, out_w, out_h): decode() then resize()."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpeg", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__jpeg(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    JpegError = PyErr_NewException("shardloader.codecs._jpeg.JpegError", NULL, NULL);
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
