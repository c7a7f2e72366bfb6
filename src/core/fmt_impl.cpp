// fmt_impl.cpp — fmt's formatting code compiled once, into libdmoe.
//
// Why: with fmt header-only (FMT_HEADER_ONLY) every translation unit that includes core/error.hpp compiled
// fmt's whole implementation again (~3.3 s of the ~3.8 s a one-line fmt::format file takes at -O3), over
// ~150 files and four builds in CI. Linking the distribution's libfmt.so instead would tie the binary to
// that library version (a build made here must run unchanged on the GPU machine), so this file does what
// fmt's own library build does: the non-template functions come from format-inl.h, and the templates the
// rest of the code calls through extern declarations are instantiated here, for char. The list is what
// fmt 9's headers declare extern (CMakeLists.txt uses this file only with fmt 9.x and stays header-only
// otherwise); a missing one is a link error, never a silent change.
#include <fmt/format.h>

#if FMT_VERSION >= 90000 && FMT_VERSION < 100000 && !defined(FMT_HEADER_ONLY)
#include <fmt/format-inl.h>

FMT_BEGIN_NAMESPACE
namespace detail {
template auto dragonbox::to_decimal(float x) noexcept -> dragonbox::decimal_fp<float>;
template auto dragonbox::to_decimal(double x) noexcept -> dragonbox::decimal_fp<double>;
template auto thousands_sep_impl(locale_ref) -> thousands_sep_result<char>;
template auto decimal_point_impl(locale_ref) -> char;
template void buffer<char>::append(const char*, const char*);
template void vformat_to(buffer<char>&, string_view, basic_format_args<FMT_BUFFER_CONTEXT(char)>, locale_ref);
template locale_ref::locale_ref(const std::locale& loc);
template auto locale_ref::get<std::locale>() const -> std::locale;
}  // namespace detail
FMT_END_NAMESPACE
#endif
