/* The upload's hot loop in C: the common chat line's checks (domain/strict_lines.py) and the
 * table of custom_id hashes (domain/custom_ids.py).
 *
 * Validation decodes each line in C (msgspec) and then ran a few dozen bytecodes per line: the
 * fast path's comparisons and sums, and the probe of the custom_id into a table of megabytes,
 * a cache miss the interpreter cannot hide. Together they took as long as the decode itself.
 * Here the probes take the hashes a few ids ahead and prefetch their slots.
 *
 * Each function has its twin in Python (add_ids_py, rehash_py, chat_run_py), used where this
 * module was not built; the tests run both against the same cases.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* The table: a writable buffer of signed 64-bit integers whose length is a power of two. */
static int
table_view(PyObject *obj, Py_buffer *view, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return -1;
    Py_ssize_t slots = view->len / 8;
    if (view->itemsize != 8 || view->format == NULL || strcmp(view->format, "q") != 0 ||
        slots == 0 || (slots & (slots - 1)) != 0) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be an array('q') whose length is a power of two", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Linear probing, as CustomIds does it: the first free slot from h & mask; 0 is free. */
static inline int
insert(long long *table, Py_ssize_t mask, long long h)
{
    Py_ssize_t slot = (Py_ssize_t)(h & mask);
    long long stored;
    while ((stored = table[slot]) != 0) {
        if (stored == h)
            return 0;
        slot = (slot + 1) & mask;
    }
    table[slot] = h;
    return 1;
}

enum { AHEAD = 8 };

PyDoc_STRVAR(add_ids_doc,
"add_ids(table, ids, start) -> int\n\n"
"Store the hash of each of ids[start:] (0 stands for 1) until one is already in the table;\n"
"return that id's index, not stored, or len(ids) when all were stored.");

static PyObject *
add_ids(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "add_ids(table, ids, start) takes 3 arguments");
        return NULL;
    }
    if (!PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "ids must be a list");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[2]);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    if (table_view(args[0], &view, "table") < 0)
        return NULL;
    long long *table = (long long *)view.buf;
    Py_ssize_t mask = view.len / 8 - 1;
    PyObject *ids = args[1];
    if (i < 0)
        i = 0;
    if (i > PyList_GET_SIZE(ids))
        i = PyList_GET_SIZE(ids);
    /* Hashes taken AHEAD ids before their probe, their slots prefetched meanwhile. A str
       subclass's own __hash__ may run Python code that changes the list: its item is held
       while it is hashed, and the list's length read again each time. */
    long long ring[AHEAD];
    Py_ssize_t hashed = i;
    PyObject *result = NULL;
    for (; i < PyList_GET_SIZE(ids); i++) {
        while (hashed < PyList_GET_SIZE(ids) && hashed < i + AHEAD) {
            PyObject *id = PyList_GET_ITEM(ids, hashed);
            if (!PyUnicode_Check(id)) {
                PyErr_Format(PyExc_TypeError, "ids[%zd] is not a str", hashed);
                goto done;
            }
            Py_INCREF(id);
            Py_hash_t h = PyObject_Hash(id);
            Py_DECREF(id);
            if (h == -1 && PyErr_Occurred())
                goto done;
            if (h == 0)
                h = 1;
            ring[hashed % AHEAD] = (long long)h;
            __builtin_prefetch(&table[h & mask], 1);
            hashed++;
        }
        if (!insert(table, mask, ring[i % AHEAD]))
            break;
    }
    result = PyLong_FromSsize_t(i);
done:
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(rehash_doc,
"rehash(old, new) -> None\n\n"
"Store every hash of the table old in the empty table new.");

static PyObject *
rehash(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "rehash(old, new) takes 2 arguments");
        return NULL;
    }
    Py_buffer old, new;
    if (table_view(args[0], &old, "old") < 0)
        return NULL;
    if (table_view(args[1], &new, "new") < 0) {
        PyBuffer_Release(&old);
        return NULL;
    }
    const long long *from = (const long long *)old.buf;
    long long *to = (long long *)new.buf;
    Py_ssize_t slots = old.len / 8, mask = new.len / 8 - 1;
    for (Py_ssize_t k = 0; k < slots; k++) {
        if (from[k])
            insert(to, mask, from[k]);
    }
    PyBuffer_Release(&old);
    PyBuffer_Release(&new);
    Py_RETURN_NONE;
}

/* The attribute names chat_run reads, interned once. */
static PyObject *s_custom_id, *s_body, *s_section, *s_messages, *s_max_tokens,
    *s_max_completion_tokens;

/* A str of 1 to max_bytes bytes of UTF-8, told from its length where that settles it:
   1 if so, 0 if not, -1 where only its UTF-8 would tell (the caller's Python checks it). */
static int
short_enough(PyObject *text, Py_ssize_t max_bytes)
{
    Py_ssize_t chars = PyUnicode_GET_LENGTH(text);
    if (chars == 0)
        return 0;
    if (chars * 4 <= max_bytes)
        return 1; /* a character is at most 4 bytes of UTF-8 */
    if (PyUnicode_IS_ASCII(text))
        return chars <= max_bytes;
    return -1;
}

PyDoc_STRVAR(chat_run_doc,
"chat_run(lines, start, decode, errors, context, max_id_bytes, ids)\n"
"    -> (stop, prompt_bound, max_output, missed)\n\n"
"Accept lines[start:] while each is the common chat line: decode (the strict chat decoder)\n"
"takes it, it has an output limit, and its custom_id and section are short enough. Each\n"
"accepted line's custom_id is appended to ids, its prompt-token bound (its bytes and 8 a\n"
"message, at most context) and output limit summed. stop is the first line not accepted\n"
"(len(lines) when all were); missed is true when decode refused it with one of errors.\n"
"strict_lines.chat_run_py is the same in Python.");

static PyObject *
chat_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "chat_run(lines, start, decode, errors, context, max_id_bytes, ids) "
                        "takes 7 arguments");
        return NULL;
    }
    PyObject *lines = args[0], *decode = args[2], *errors = args[3], *ids = args[6];
    if (!PyList_Check(lines) || !PyList_Check(ids)) {
        PyErr_SetString(PyExc_TypeError, "lines and ids must be lists");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    long long context = PyLong_AsLongLong(args[4]);
    if (context == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t max_id_bytes = PyLong_AsSsize_t(args[5]);
    if (max_id_bytes == -1 && PyErr_Occurred())
        return NULL;
    if (i < 0)
        i = 0;
    if (i > PyList_GET_SIZE(lines))
        i = PyList_GET_SIZE(lines);
    long long prompt_bound = 0, max_output = 0;
    int missed = 0;
    /* The list of lines is only read; decode (msgspec's, in C) runs no Python code, but each
       line is held while it is decoded all the same, and the length read again each time. */
    for (; i < PyList_GET_SIZE(lines); i++) {
        PyObject *raw = PyList_GET_ITEM(lines, i);
        if (!PyBytes_Check(raw)) {
            PyErr_Format(PyExc_TypeError, "lines[%zd] is not bytes", i);
            return NULL;
        }
        Py_INCREF(raw);
        PyObject *line = PyObject_CallOneArg(decode, raw);
        Py_ssize_t size = PyBytes_GET_SIZE(raw);
        Py_DECREF(raw);
        if (line == NULL) {
            if (!PyErr_ExceptionMatches(errors))
                return NULL;
            PyErr_Clear();
            missed = 1;
            break;
        }
        PyObject *cid = NULL, *body = NULL, *section = NULL, *limit = NULL, *messages = NULL;
        int accept = 0;
        if ((cid = PyObject_GetAttr(line, s_custom_id)) == NULL ||
            (body = PyObject_GetAttr(line, s_body)) == NULL ||
            (section = PyObject_GetAttr(line, s_section)) == NULL ||
            (limit = PyObject_GetAttr(body, s_max_completion_tokens)) == NULL)
            goto failed;
        if (limit == Py_None) {
            /* Either limit is absent or above 0 here: the completion one wins, as the rule. */
            Py_DECREF(limit);
            if ((limit = PyObject_GetAttr(body, s_max_tokens)) == NULL)
                goto failed;
        }
        if ((messages = PyObject_GetAttr(body, s_messages)) == NULL)
            goto failed;
        if (limit != Py_None && PyLong_CheckExact(limit) && PyUnicode_CheckExact(cid) &&
            PyList_CheckExact(messages) && short_enough(cid, max_id_bytes) == 1 &&
            (section == Py_None ||
             (PyUnicode_CheckExact(section) && short_enough(section, max_id_bytes) == 1))) {
            long long out = PyLong_AsLongLong(limit);
            if (out == -1 && PyErr_Occurred())
                goto failed;
            if (PyList_Append(ids, cid) < 0)
                goto failed;
            long long bound = (long long)size + 8 * ((long long)PyList_GET_SIZE(messages) + 1);
            prompt_bound += bound < context ? bound : context;
            max_output += out;
            accept = 1;
        }
        Py_DECREF(line);
        Py_DECREF(cid);
        Py_DECREF(body);
        Py_DECREF(section);
        Py_DECREF(limit);
        Py_DECREF(messages);
        if (!accept)
            break;
        continue;
    failed:
        Py_DECREF(line);
        Py_XDECREF(cid);
        Py_XDECREF(body);
        Py_XDECREF(section);
        Py_XDECREF(limit);
        Py_XDECREF(messages);
        return NULL;
    }
    return Py_BuildValue("(nLLO)", i, prompt_bound, max_output, missed ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"add_ids", (PyCFunction)(void (*)(void))add_ids, METH_FASTCALL, add_ids_doc},
    {"rehash", (PyCFunction)(void (*)(void))rehash, METH_FASTCALL, rehash_doc},
    {"chat_run", (PyCFunction)(void (*)(void))chat_run, METH_FASTCALL, chat_run_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "backfill.domain._speedups",
    "The custom_id table's probes in C (see domain/custom_ids.py).",
    0,
    methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    if ((s_custom_id = PyUnicode_InternFromString("custom_id")) == NULL ||
        (s_body = PyUnicode_InternFromString("body")) == NULL ||
        (s_section = PyUnicode_InternFromString("section")) == NULL ||
        (s_messages = PyUnicode_InternFromString("messages")) == NULL ||
        (s_max_tokens = PyUnicode_InternFromString("max_tokens")) == NULL ||
        (s_max_completion_tokens = PyUnicode_InternFromString("max_completion_tokens")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
