/* The records of a torch.save archive held whole in memory, in C: core/zipio.py read_records' fast path.

   A DCP rank file of a wide checkpoint is thousands of small torch.save archives (one per chunk, seven records
   each) and every rank of a ZeRO-3 run saves the same 2,000-record model states; parsing their directories in
   Python costs ~7 us a record, here well under one. This walk only accepts: an archive laid out exactly as
   torch.save writes one (zipio._plain_directory's conditions), whose records read_records would accept too
   (plain names inside the first entry's folder, stored, unencrypted, local headers that name the same record,
   payloads inside the archive, one after another). Anything else returns None and the Python path decides,
   with its own words; tests/test_fast_paths.py runs both on damaged archives and compares. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_EXTRACT_VERSION 63 /* zipfile.MAX_EXTRACT_VERSION */
#define END_SIZE 22
#define LOCATOR_SIZE 20
#define END64_SIZE 56
#define CENTRAL_SIZE 46
#define LOCAL_SIZE 30

static uint16_t u16(const unsigned char *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t u32(const unsigned char *p) { return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24); }
static uint64_t u64(const unsigned char *p) { return (uint64_t)u32(p) | ((uint64_t)u32(p + 4) << 32); }

/* zipio._plain_part: not "", "." or "..", no backslash, no control character (names here are ASCII, no NUL). */
static int plain_part(const unsigned char *p, Py_ssize_t n) {
    if (n == 0 || (n == 1 && p[0] == '.') || (n == 2 && p[0] == '.' && p[1] == '.')) return 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (p[i] == '\\' || p[i] < 0x20 || p[i] == 0x7f) return 0;
    return 1;
}

/* zipio._plain_member's condition on the name after the folder: non-empty, every '/'-separated part plain. */
static int plain_name(const unsigned char *p, Py_ssize_t n) {
    Py_ssize_t start = 0;
    if (n == 0) return 0;
    for (Py_ssize_t i = 0; i <= n; i++) {
        if (i == n || p[i] == '/') {
            if (!plain_part(p + start, i - start)) return 0;
            start = i + 1;
        }
    }
    return 1;
}

static PyObject *records(PyObject *self, PyObject *args) {
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*", &view)) return NULL;
    const unsigned char *buf = view.buf;
    const Py_ssize_t len = view.len;
    PyObject *out = NULL;

    /* End records (zipio._directory_span with base 0). */
    Py_ssize_t end = len - END_SIZE;
    if (end < 0 || u32(buf + end) != 0x06054B50 || u16(buf + end + 20) != 0) goto fallback;
    uint64_t disk = u16(buf + end + 4), cd_disk = u16(buf + end + 6), on_disk = u16(buf + end + 8), count = u16(buf + end + 10);
    uint64_t cd_size = u32(buf + end + 12), cd_offset = u32(buf + end + 16);
    Py_ssize_t cd_end = end;
    if (end >= LOCATOR_SIZE && memcmp(buf + end - LOCATOR_SIZE, "PK\x06\x07", 4) == 0) {
        const unsigned char *loc = buf + end - LOCATOR_SIZE;
        if (u32(loc + 4) != 0 || u32(loc + 16) > 1) goto fallback;
        cd_end = end - LOCATOR_SIZE - END64_SIZE;
        if (cd_end < 0) goto fallback;
        const unsigned char *e64 = buf + cd_end;
        if (u32(e64) != 0x06064B50) goto fallback;
        disk = u32(e64 + 16);
        cd_disk = u32(e64 + 20);
        on_disk = u64(e64 + 24);
        count = u64(e64 + 32);
        cd_size = u64(e64 + 40);
        cd_offset = u64(e64 + 48);
    }
    if (disk || cd_disk || on_disk != count || count == 0 || cd_offset > (uint64_t)cd_end || cd_size != (uint64_t)cd_end - cd_offset)
        goto fallback;
    if (count > (uint64_t)(cd_end - (Py_ssize_t)cd_offset) / CENTRAL_SIZE) goto fallback;

    out = PyList_New((Py_ssize_t)count);
    if (out == NULL) goto done;
    Py_ssize_t pos = (Py_ssize_t)cd_offset, top_len = -1, previous_end = 0;
    for (uint64_t i = 0; i < count; i++) {
        if (pos + CENTRAL_SIZE > cd_end) goto fallback;
        const unsigned char *c = buf + pos;
        uint32_t flags = u16(c + 8), method = u16(c + 10), crc = u32(c + 16), csize = u32(c + 20), usize = u32(c + 24);
        Py_ssize_t name_len = u16(c + 28), extra_len = u16(c + 30), comment_len = u16(c + 32);
        Py_ssize_t header = (Py_ssize_t)u32(c + 42);
        const unsigned char *name = c + CENTRAL_SIZE;
        if (u32(c) != 0x02014B50 || c[6] > MAX_EXTRACT_VERSION || extra_len || comment_len) goto fallback;
        if (pos + CENTRAL_SIZE + name_len > cd_end) goto fallback;
        for (Py_ssize_t k = 0; k < name_len; k++)
            if (name[k] == 0 || name[k] > 0x7f) goto fallback;
        if (top_len < 0) { /* zipio._top_folder: the first entry's folder */
            const unsigned char *slash = memchr(name, '/', (size_t)name_len);
            if (slash == NULL || !plain_part(name, slash - name)) goto fallback;
            top_len = slash - name + 1;
        }
        if (name_len < top_len || memcmp(name, buf + cd_offset + CENTRAL_SIZE, (size_t)top_len) != 0) goto fallback;
        if (!plain_name(name + top_len, name_len - top_len)) goto fallback;
        if (method != 0 || csize != usize || (flags & 1)) goto fallback;
        /* Local header: in the archive, before the directory, after the previous record, naming this record. */
        if (header < previous_end || header > len - LOCAL_SIZE || memcmp(buf + header, "PK\x03\x04", 4) != 0) goto fallback;
        Py_ssize_t local_name = u16(buf + header + 26), local_extra = u16(buf + header + 28);
        if (local_name != name_len || header + LOCAL_SIZE + name_len > len) goto fallback;
        if (memcmp(buf + header + LOCAL_SIZE, name, (size_t)name_len) != 0) goto fallback;
        Py_ssize_t data = header + LOCAL_SIZE + local_name + local_extra;
        if (data + (Py_ssize_t)usize > len) goto fallback;
        previous_end = data + (Py_ssize_t)usize;
        PyObject *item = Py_BuildValue("(s#nkk)", (const char *)name + top_len, name_len - top_len, data, (unsigned long)usize,
                                       (unsigned long)crc);
        if (item == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, item);
        pos += CENTRAL_SIZE + name_len;
    }
    if (pos != cd_end) goto fallback;
    goto done;

fallback:
    Py_XDECREF(out);
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"records", records, METH_VARARGS, "records(archive) -> [(name, data_offset, size, crc)] or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_zip_scan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__zip_scan(void) { return PyModule_Create(&module); }
