// cpp-httplib as Debian builds it. libcpp-httplib.so is compiled with OpenSSL, zlib and Brotli
// support, and the layout of its classes (httplib::Request, ClientImpl) depends on those
// macros: every file including httplib.h must define them as the library did (pkg-config's
// `cpp-httplib` cflags), or it reads the library's objects at the wrong offsets.
#pragma once

#ifndef CPPHTTPLIB_OPENSSL_SUPPORT
#define CPPHTTPLIB_OPENSSL_SUPPORT
#endif
#ifndef CPPHTTPLIB_ZLIB_SUPPORT
#define CPPHTTPLIB_ZLIB_SUPPORT
#endif
#ifndef CPPHTTPLIB_BROTLI_SUPPORT
#define CPPHTTPLIB_BROTLI_SUPPORT
#endif
#include <httplib.h>
