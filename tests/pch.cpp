// The program that carries the test programs' shared precompiled header (CMakeLists.txt,
// octet_test_pch): GoogleTest's main with no tests.
