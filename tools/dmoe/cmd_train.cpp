// dmoe train — train a Mixtral model from byte-level text on the CPU engine or the GPU (src/model/trainer.hpp).
//
//   dmoe train --config tiny --data /usr/share/common-licenses --steps 200 --seq 64 --batch 8
//         [--world W] [--init random|CKPT] [--resume DIR] [--save DIR] [--log FILE] [--lr 3e-3] ...
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "model/config_io.hpp"
#include "core/output_file.hpp"
#include "model/checkpoint.hpp"
#include "model/mixtral_config.hpp"
#include "model/trainer.hpp"
#include "options.hpp"

namespace dmoe::cli {

namespace {

// Before training: --log (truncated at the start) must not be one of the files the run reads, and --save
// must be a directory or a new name, not the data (the checkpoint's files would land among the text).
void check_train_paths(const TrainOptions& o, const std::string& config_file) {
  namespace fs = std::filesystem;
  // `--save -ck` was refused only at its first file ("output '-ck/model.safetensors'"), after the directory was made.
  DMOE_REQUIRE_INPUT(o.save_dir.empty() || o.save_dir[0] != '-', "--save '{}': a path that starts with '-' reads as an "
                     "option; give ./{} for a directory of that name", o.save_dir, o.save_dir);
  std::vector<NamedPath> inputs = {{"--config", config_file}, {"--data", o.data_path}};
  if (o.init != "random") {
    inputs.push_back({"--init", o.init});
    // A model directory or a sharded index: every file it reads (a --log onto a shard replaced the model).
    for (const std::string& f : checkpoint_files(o.init)) inputs.push_back({"--init", f});
  }
  std::error_code ec;
  if (fs::is_directory(o.data_path, ec))
    for (const auto& e : fs::directory_iterator(o.data_path, ec))
      if (fs::is_regular_file(e.path(), ec)) inputs.push_back({"--data", e.path().string()});
  if (!o.resume_dir.empty())
    for (const char* name : {"trainer_state.json", "model.safetensors", "optimizer.safetensors", "config.json"})
      inputs.push_back({"--resume", (fs::path(o.resume_dir) / name).string()});
  if (!o.log_path.empty()) {
    // A resumed run appends to an existing log in place (the trainer's GrowingOutputFile with append), it never renames
    // it: a bind-mounted log, or another user's shared log in a sticky directory, was refused as one rename(2) cannot
    // replace (G21-5, twenty-first pass). The rename's checks are for a new log only.
    if (!o.resume_dir.empty() && fs::exists(o.log_path, ec))
      check_appended_output_file(o.log_path, "--log");
    else
      check_output_file(o.log_path, "--log");
    require_distinct_files({{"--log", o.log_path}}, inputs);
  }
  // The tuning file is read (when it exists) and written after the tuning steps: not one of the other files.
  if (!o.tune_file.empty()) {
    std::vector<NamedPath> others = inputs;
    if (!o.log_path.empty()) others.push_back({"--log", o.log_path});
    if (!o.save_dir.empty())
      for (const char* name : {"trainer_state.json", "model.safetensors", "optimizer.safetensors", "config.json",
                               kCheckpointJournal})
        others.push_back({"--save", (fs::path(o.save_dir) / name).string()});
    require_distinct_files({{"--tune-file", o.tune_file}}, others);
  }
  // A new --log or --tune-file in the --data directory: this run reads the text before the file exists, but every later
  // run on that --data trains on the log too (one that exists is refused above, as one of --data's files).
  if (fs::is_directory(o.data_path, ec))
    for (const NamedPath& out : {NamedPath{"--log", o.log_path}, NamedPath{"--tune-file", o.tune_file}})
      DMOE_REQUIRE_INPUT(out.path.empty() || !same_file(fs::path(out.path).has_parent_path()
                                                            ? fs::path(out.path).parent_path().string() : ".",
                                                        o.data_path),
                         "{} '{}' is in the --data directory '{}', whose files are the training text: later runs on it "
                         "would train on this {}; write it elsewhere", out.option, out.path, o.data_path,
                         out.option == "--log" ? "log" : "tuning file");
  // --save is made a directory at the end: as the path of a new --log or --tune-file (or below it) the training ran to
  // the end and then failed with "unexpected error: filesystem error: cannot create directories".
  if (!o.save_dir.empty()) {
    // Absolute and normalised; in a working directory deeper than PATH_MAX (no path can be made absolute there) the
    // paths as given, normalised: both were empty there, and every --log was refused as --save (F6 of the eighteenth
    // bad-input pass).
    const auto normal = [](const std::string& path) {
      std::error_code e;
      const fs::path absolute = fs::absolute(path, e);
      if (e) return fs::path(path).lexically_normal();
      const fs::path canonical = fs::weakly_canonical(absolute, e);
      return (e ? absolute : canonical).lexically_normal();
    };
    const fs::path save = normal(o.save_dir);
    for (const NamedPath& out : {NamedPath{"--log", o.log_path}, NamedPath{"--tune-file", o.tune_file}}) {
      if (out.path.empty()) continue;
      const fs::path file = normal(out.path);
      const auto [f, s] = std::mismatch(file.begin(), file.end(), save.begin(), save.end());
      DMOE_REQUIRE_INPUT(f != file.end(), "--save '{}' is {} '{}'{}: the checkpoint is a directory, the {} a file; give "
                         "them different paths", o.save_dir, out.option, out.path, s == save.end() ? "" : " or inside it",
                         out.option == "--log" ? "log" : "tuning file");
    }
  }
  if (!o.save_dir.empty()) {
    DMOE_REQUIRE_INPUT(!fs::exists(o.save_dir, ec) || fs::is_directory(o.save_dir, ec),
                       "--save '{}' exists and is not a directory; a checkpoint is a directory (model.safetensors, "
                       "config.json, optimizer.safetensors, trainer_state.json): give a directory or a new name",
                       o.save_dir);
    DMOE_REQUIRE_INPUT(!same_file(o.save_dir, o.data_path),
                       "--save '{}' is the --data directory; the checkpoint's files would become training text: "
                       "give another directory", o.save_dir);
    // The checkpoint is written after the training: a directory where it cannot be written is refused now (the error
    // came after the whole run), and so is one that holds files of the checkpoint's names without being a dmoe
    // checkpoint (an unrelated config.json or model.safetensors was replaced without a word).
    if (fs::is_directory(o.save_dir, ec)) {
      // The checkpoint is one model.safetensors: beside an index.json, readers of the directory (eval --weights DIR,
      // --init DIR) would read the index's shards, not the saved model.
      DMOE_REQUIRE_INPUT(!fs::exists(fs::symlink_status(fs::path(o.save_dir) / "model.safetensors.index.json", ec)),
                         "--save '{}' holds a model.safetensors.index.json: the checkpoint's model.safetensors would "
                         "be saved beside it, and readers of the directory (eval --weights, train --init) read the "
                         "index's shards instead; give a new or empty directory", o.save_dir);
      if (!fs::exists(fs::path(o.save_dir) / "trainer_state.json", ec))
        for (const char* name : {"model.safetensors", "optimizer.safetensors", "config.json"})
          DMOE_REQUIRE_INPUT(!fs::exists(fs::symlink_status(fs::path(o.save_dir) / name, ec)),
                             "--save '{}' holds a {} but no trainer_state.json: it is not a dmoe checkpoint, and "
                             "saving would replace that file; give a new or empty directory, or a dmoe checkpoint's",
                             o.save_dir, name);
      for (const char* name : {"trainer_state.json", "model.safetensors", "optimizer.safetensors", "config.json"})
        check_output_file((fs::path(o.save_dir) / name).string(), "--save");
      // G22A-1: a checkpoint file that is a symbolic link out of the checkpoint directory (ck/model.safetensors ->
      // ../shared/model.safetensors) trained every step, then failed the save with an internal check: a save is one
      // journaled set, its renames and its journal's names all in the checkpoint's own directory, which a file
      // elsewhere cannot join. Decided: refused here, before the training, naming the link; the save neither writes
      // through it onto the other directory's file nor replaces the link with a file of its own (which would silently
      // cut the checkpoint off from the file the user linked). A link to another file of the same directory
      // (config.json -> cfg0.json) stays allowed and is written through, the directories compared by identity (`--save
      // lnk`, lnk -> real/ck, is the same directory as real/ck).
      for (const char* name : {"trainer_state.json", "model.safetensors", "optimizer.safetensors", "config.json"}) {
        const fs::path file = fs::path(o.save_dir) / name;
        if (!fs::is_symlink(fs::symlink_status(file, ec))) continue;
        char* real = ::realpath(file.c_str(), nullptr);
        if (!real) continue;  // check_output_file above names a link that cannot be resolved
        const std::string target = real;
        std::free(real);
        const fs::path parent = fs::path(target).parent_path();
        DMOE_REQUIRE_INPUT(same_file(parent.string(), o.save_dir), "--save '{}': its {} is a symbolic link to '{}', "
                           "outside the checkpoint directory: a save replaces the checkpoint's files together, as one "
                           "set inside that directory, so it can neither write through the link into '{}' nor replace "
                           "the link: make it a file of its own (cp --remove-destination '{}' '{}'), or give another "
                           "--save directory", o.save_dir, name, target, parent.string(), target, file.string());
      }
      // G23A-1: two of the checkpoint's files that are one file (ck/config.json -> model.safetensors, a link that
      // stays inside the directory, or two hard links): the save wrote both through it onto that one file, rc 0
      // "saved", and the trained weights were gone (the file held the config). Refused before the training, naming
      // both; compared by identity, links followed.
      {
        const char* const names[] = {"model.safetensors", "config.json", "optimizer.safetensors", "trainer_state.json"};
        for (size_t i = 0; i < std::size(names); ++i)
          for (size_t j = i + 1; j < std::size(names); ++j) {
            const fs::path a = fs::path(o.save_dir) / names[i], b = fs::path(o.save_dir) / names[j];
            if (!fs::exists(a, ec) || !fs::exists(b, ec) || !same_file(a.string(), b.string())) continue;
            const bool a_link = fs::is_symlink(fs::symlink_status(a, ec));
            const bool b_link = fs::is_symlink(fs::symlink_status(b, ec));
            const std::string link = a_link ? a.string() : b.string();
            if (a_link || b_link)
              DMOE_FAIL_INPUT("--save '{}': its {} and its {} are one file (through the symbolic link '{}'): a save "
                              "writes each of the checkpoint's four files as a file of its own, and would write "
                              "both through the link onto that one file, the trained weights lost; remove the link "
                              "'{}' (or make it a file of its own), or give another --save directory", o.save_dir,
                              names[i], names[j], link, link);
            DMOE_FAIL_INPUT("--save '{}': its {} and its {} are one file (hard links): each of the checkpoint's four "
                            "files must be a file of its own; make them so (cp '{}' '{}.copy' && mv '{}.copy' '{}'), "
                            "or give another --save directory", o.save_dir, names[i], names[j], b.string(), b.string(),
                            b.string(), b.string());
          }
      }
      // The save's journal (docs/model.md) is dmoe's own name: a link there would have the journal written through it
      // onto its target, and a directory or FIFO failed the save only after the training (H4, H8 of the seventeenth
      // pass).
      const fs::path journal = fs::path(o.save_dir) / kCheckpointJournal;
      const fs::file_status js = fs::symlink_status(journal, ec);
      DMOE_REQUIRE_INPUT(!fs::exists(js) || fs::is_regular_file(js), "--save '{}' holds '{}', which is not a regular "
                         "file: that name is the journal each save writes (which temporary goes onto which file); move "
                         "it away", o.save_dir, journal.string());
    } else {  // created at the end, with its missing parents: the nearest existing one must take a new file
      // The nearest part of the path that is there as a name, links not followed: a dangling symbolic link or a link
      // loop as --save (or above it) was taken for a missing directory, and the run trained to the end and then failed
      // with "the checkpoint directory cannot be made: File exists" (or "Too many levels of symbolic links").
      fs::path existing = fs::absolute(o.save_dir, ec);
      std::error_code link_ec;
      while (!existing.empty() && !fs::exists(fs::symlink_status(existing, link_ec)) &&
             existing != existing.parent_path())
        existing = existing.parent_path();
      std::error_code target_ec;
      const bool is_dir = fs::is_directory(fs::status(existing, target_ec));
      DMOE_REQUIRE_INPUT(is_dir || !fs::is_symlink(fs::symlink_status(existing, link_ec)), "--save '{}': '{}' is a "
                         "symbolic link that leads to no directory ({}), so the checkpoint directory cannot be made "
                         "there; give a directory, or a new name", o.save_dir, existing.string(),
                         target_ec ? target_ec.message() : std::string("its target is not a directory"));
      DMOE_REQUIRE_INPUT(is_dir, "--save '{}': '{}' is not a directory, so the checkpoint directory cannot be made in "
                         "it", o.save_dir, existing.string());
      // A directory made there and removed (a probe file's name in the error named a path the user never gave:
      // "--save '/proc/.dmoe-save-check'"; H14 of the seventeenth pass).
      // G22A-5: not in an append-only directory (chattr +a): a directory may be made there, and the checkpoint's is,
      // but not removed again, so the probe stayed for good, one per run (its rmdir's failure unseen). There the
      // trainer makes the checkpoint directory itself before its first step (and says so if it cannot). A probe that
      // cannot be removed elsewhere (an LSM rule) is named rather than left without a word.
      int flags = 0;
      if (const int fd = ::open(existing.c_str(), O_RDONLY | O_DIRECTORY | O_NONBLOCK | O_CLOEXEC); fd >= 0) {
        if (::ioctl(fd, FS_IOC_GETFLAGS, &flags) != 0) flags = 0;  // no attributes here (tmpfs, /proc)
        ::close(fd);
      }
      if (!(flags & FS_APPEND_FL)) {
        std::string probe = (existing / ".dmoe-save-check.XXXXXX").string();
        if (::mkdtemp(probe.data()) == nullptr)
          DMOE_FAIL_INPUT("--save '{}': the checkpoint directory cannot be made in '{}': {}", o.save_dir,
                          existing.string(), std::strerror(errno));
        if (::rmdir(probe.c_str()) != 0)
          DMOE_FAIL_INPUT("--save '{}': the directory '{}' that dmoe made in '{}' (to find out whether the "
                          "checkpoint directory can be made there) cannot be removed again ({}): remove it by hand, "
                          "and give --save in a directory where dmoe may remove what it makes", o.save_dir, probe,
                          existing.string(), std::strerror(errno));
      }
      // A name the file system cannot take (a component past NAME_MAX, or a path whose files would pass PATH_MAX)
      // trained to the end and then failed with "the checkpoint directory cannot be made: File name too long".
      const long name_max = ::pathconf(existing.c_str(), _PC_NAME_MAX);
      for (const fs::path& part : fs::path(o.save_dir))
        DMOE_REQUIRE_INPUT(name_max <= 0 || part.string().size() <= size_t(name_max), "--save '{}': its part '{}' is "
                           "{} bytes, more than the {} a file name may have in '{}'; the checkpoint directory could not "
                           "be made: give a shorter name", o.save_dir, part.string(), part.string().size(), name_max,
                           existing.string());
      // The checkpoint's files are opened as --save/NAME (their temporaries' names take up to 64 bytes).
      DMOE_REQUIRE_INPUT(o.save_dir.size() + 64 < PATH_MAX, "--save '{}' is {} bytes long: its checkpoint files' "
                         "paths would pass the {} bytes a path may have (PATH_MAX); give a shorter path", o.save_dir,
                         o.save_dir.size(), PATH_MAX);
    }
    // The checkpoint's files must not be the weights the run starts from (--init ck/model.safetensors --save ck
    // replaced that model with the trained one, rc 0) or its text; --resume into its own directory is the exception
    // (the run's checkpoint moves on), and so is the --config it was given (saved again as it was read).
    for (const char* name : {"trainer_state.json", "model.safetensors", "optimizer.safetensors", "config.json"})
      for (const NamedPath& in : inputs)
        DMOE_REQUIRE_INPUT((in.option != "--init" && in.option != "--data") ||
                               !same_file((fs::path(o.save_dir) / name).string(), in.path),
                           "--save '{}' would replace its {}, which is {} '{}' of this run: the checkpoint would "
                           "destroy that input; give another --save directory", o.save_dir, name, in.option,
                           in.path);
    if (!o.log_path.empty())
      for (const char* name : {"trainer_state.json", "model.safetensors", "optimizer.safetensors", "config.json",
                               kCheckpointJournal})
        DMOE_REQUIRE_INPUT(!same_file(o.log_path, (fs::path(o.save_dir) / name).string()),
                           "--log '{}' is the checkpoint's {} in --save '{}': saving would replace the log; give "
                           "another --log", o.log_path, name, o.save_dir);
  }
}

// A bare --resume continues the saved run exactly: the settings its trainer_state.json records are taken for the
// options not given here. They used to be the defaults, each "replacing the saved run's" value with a note: `train
// --resume ck` after `--steps 6 --lr 0.002 --warmup 3` ran a 100-step schedule at 0.003 with 10 warm-up steps. Values
// outside an option's range are refused naming the file (a state of "steps": 1e11 was taken). The trainer checks the
// rest of the state (types, seed, model) and notes what a given option changes.
void adopt_saved_settings(TrainOptions& o, const CLI::App& sub, int64_t max_steps) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(o.resume_dir) / "trainer_state.json").string();
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return;  // the trainer says what is missing
  // Through the size-limited reader: a 2 GB state was parsed here first (46 s, 6.4 GB of memory) before its error.
  const nlohmann::json state = read_json_file(path, "--resume trainer_state.json");
  if (!state.is_object()) return;  // the trainer names what is wrong with it
  // A key the state lacks (hand-edited, or written by an older dmoe) leaves the option's default: said, since the run
  // then is not the saved one (a state without "steps" ran 100 steps instead of 8, without a word).
  const auto saved = [&](const char* key, const char* option) {
    if (sub.count(option) != 0) return false;
    if (!state.contains(key)) {
      std::printf("train: note: --resume %s: trainer_state.json has no '%s'; %s takes its default (give %s to set "
                  "it)\n", o.resume_dir.c_str(), key, option, option);
      return false;
    }
    return state.at(key).is_number();  // other types: the trainer names them
  };
  const auto adopt_int = [&](const char* key, const char* option, int64_t& field, int64_t lo, int64_t hi) {
    if (!saved(key, option)) return;
    // 2.0 is the integer 2 (a JSON writer may print it so); 2.5 is no step count. Either used to be skipped, and the
    // default taken with a note as if given.
    const double real = state.at(key).get<double>();
    DMOE_REQUIRE_INPUT(std::isfinite(real) && real == std::floor(real) && std::fabs(real) < 9.2e18,
                       "--resume {}: trainer_state.json's '{}' = {} is not a whole number, which {} must be; give {} "
                       "to replace it", o.resume_dir, key, state.at(key).dump(), option, option);
    const int64_t v = state.at(key).is_number_integer() ? state.at(key).get<int64_t>() : int64_t(real);
    DMOE_REQUIRE_INPUT(v >= lo && v <= hi, "--resume {}: trainer_state.json's '{}' = {} is outside [{}, {}], the range "
                       "of {}; give {} to replace it", o.resume_dir, key, v, lo, hi, option, option);
    field = v;
    o.from_state.insert(option);
  };
  const auto adopt_real = [&](const char* key, const char* option, double& field, double lo, double hi) {
    if (!saved(key, option)) return;
    const double v = state.at(key).get<double>();
    DMOE_REQUIRE_INPUT(std::isfinite(v) && v >= lo && v <= hi, "--resume {}: trainer_state.json's '{}' = {} is outside "
                       "[{}, {}], the range of {}; give {} to replace it", o.resume_dir, key, v, lo, hi, option, option);
    field = v;
    o.from_state.insert(option);
  };
  adopt_int("steps", "--steps", o.steps, 1, max_steps);
  adopt_int("batch", "--batch", o.batch, 1, int64_t(1) << 20);
  adopt_int("seq", "--seq", o.seq, 2, int64_t(1) << 20);
  adopt_int("warmup", "--warmup", o.warmup, 0, max_steps);
  if (saved("seed", "--seed") && state.at("seed").is_number_unsigned()) o.seed = state.at("seed").get<uint64_t>();
  std::fflush(stdout);
  adopt_real("lr", "--lr", o.lr, 0, 1e6);
  if (sub.count("--lr") == 0) adopt_real("min_lr", "--min-lr", o.min_lr, 0, 1e6);  // else lr/10 of the new --lr
  adopt_real("val_fraction", "--val-fraction", o.val_fraction, 0, 1);
  adopt_real("weight_decay", "--weight-decay", o.weight_decay, 0, 1e6);
  adopt_real("beta1", "--beta1", o.beta1, 0, 1);
  adopt_real("beta2", "--beta2", o.beta2, 0, 1);
  adopt_real("clip", "--clip", o.clip, 0, 1e9);
}

}  // namespace

// Step counts' upper bound in the option checks (a readable range in the error, not DBL_MAX's 309 digits).
constexpr int64_t kMaxSteps = 1000000000;

Command add_train_command(CLI::App& app) {
  auto o = std::make_shared<TrainOptions>();
  auto config = std::make_shared<std::string>();
  auto engine = std::make_shared<std::string>("cpu");
  auto dtype = std::make_shared<std::string>("f32");
  CLI::App* sub = app.add_subcommand("train", "train a Mixtral model on byte-level text (CPU or GPU engine)");
  sub->add_option("--config", *config, "HF Mixtral config.json or a named model in bench/models (e.g. tiny)")
      ->required();
  sub->add_option("--data", o->data_path, "text file (or a directory of them: the regular files directly in it, in name "
                  "order; subdirectories are skipped, with a note) whose bytes are the tokens, e.g. "
                  "/usr/share/common-licenses (Debian base-files)")->required();
  sub->add_option("--steps", o->steps, "last training step")->check(Range(int64_t(1), kMaxSteps));
  // 0 is TrainOptions' "not given": `--stop-after 0` ran the whole schedule.
  CLI::Option* stop_after = sub->add_option("--stop-after", o->stop_after, "stop (and save, with --save) after this step of the "
                                            "--steps schedule (1 to --steps; default: run to --steps)")
      ->check(Range(int64_t(0), kMaxSteps))->default_str("--steps");
  sub->add_option("--seq", o->seq, "sequence length")->check(Range(2, 1 << 20));
  sub->add_option("--batch", o->batch, "sequences per step over all ranks")->check(Range(int64_t(1), int64_t(1) << 20));
  sub->add_option("--world", o->world, "simulated ranks (batch split, experts sharded E/W)")->check(Range(1, 4096));
  sub->add_option("--micro-batches", o->micro_batches, "split each rank's share into R micro-batches (all "
                  "forwards, then all backwards; gradients averaged)")->check(Range(1, 1 << 20));
  sub->add_option("--engine", *engine, "cpu (ranks as threads, --world of them) | cuda (aliases ep, gpu; this process is "
                  "one rank of a GPU job: dmoe launch -n W / mpirun, --world W)");
  sub->add_option("--dtype", *dtype, "f32 | bf16 (cuda: the weights and activations the kernels use; master weights "
                  "and AdamW moments stay f32)");
  sub->add_option("--schedule", o->schedule, "Flow: vanilla | pipe-moe | pipe-attn | chunked-ar | tuned — each step as "
                  "a task graph on the engine's Flow executor (cpu: threads; cuda: streams; docs/flow.md); tuned: the first steps sample vanilla, then "
                  "(Sp, R) of chunked-ar with the Bayesian tuner, then run the fastest; default: the sequential loop");
  CLI::Option* chunk = sub->add_option("--chunk-bytes", o->chunk_bytes,
                                       "Flow: Sp, the all-reduce chunk of chunked-ar (default 1 MiB)");
  CLI::Option* samples = sub->add_option("--tune-samples", o->tune_samples, "Flow, --schedule tuned: samples, the vanilla baseline and N − 1 points (Sp, R); the baseline is sampled again last")
      ->capture_default_str();
  CLI::Option* steps = sub->add_option("--tune-steps", o->tune_steps,
                                       "Flow, --schedule tuned: timed steps per point, after one warm-up step")
      ->capture_default_str();
  CLI::Option* file = sub->add_option("--tune-file", o->tune_file, "Flow, --schedule tuned: write the samples and the choice here (JSON); "
                  "one entry per run shape (model, batch, seq, world, dtype): an entry of this run's shape is reused without "
                  "tuning, a new shape is added");
  sub->add_option("--init", o->init, "random, or a model.safetensors / index.json to start from");
  sub->add_option("--resume", o->resume_dir, "continue the run saved in this directory (exact resume: the options "
                  "not given take the saved run's values; one given replaces it, with a note)");
  sub->add_option("--save", o->save_dir, "write a checkpoint here at the end (and every --save-every steps)");
  sub->add_option("--save-every", o->save_every, "also save every N steps")->check(Range(int64_t(0), kMaxSteps));
  sub->add_option("--log", o->log_path, "JSON-lines log: {step, loss, lr, grad_norm, tokens_per_s}, {step, val_loss}; a "
                  "new run replaces the log at its first --save-every checkpoint or its end (a run that fails before "
                  "leaves the old log); --resume appends, after cutting the lines past its checkpoint");
  sub->add_option("--lr", o->lr, "peak learning rate");
  // Not given: lr/10 (TrainOptions' min_lr < 0). A negative value given was taken for that default without a word.
  CLI::Option* min_lr = sub->add_option("--min-lr", o->min_lr, "final learning rate of the cosine, >= 0 and <= --lr "
                                        "(default lr/10)")->default_str("lr/10");
  sub->add_option("--warmup", o->warmup, "linear warm-up steps")->check(Range(int64_t(0), kMaxSteps));
  sub->add_option("--weight-decay", o->weight_decay, "AdamW decoupled weight decay (matrices only)");
  sub->add_option("--beta1", o->beta1);
  sub->add_option("--beta2", o->beta2);
  sub->add_option("--clip", o->clip, "max global gradient norm (0: none)")->check(Range(0.0, 1e9));
  sub->add_option("--val-fraction", o->val_fraction, "held-out tail of the data");
  sub->add_option("--val-every", o->val_every, "validate every N steps (and at the end)")->check(Range(int64_t(0), kMaxSteps));
  sub->add_option("--val-batches", o->val_batches, "held-out windows = val-batches x batch")->check(Range(int64_t(1), int64_t(1) << 20));
  sub->add_option("--seed", o->seed, "data order and random init");
  sub->add_option("--print-every", o->print_every, "progress line every N steps (0: none)")->check(Range(int64_t(0), kMaxSteps));
  CLI::Option* f32_grads = sub->add_flag(
      "--f32-expert-grads", o->f32_expert_grads,
      "cuda, bf16: keep the experts' gradients in f32 where they would be bf16 (one micro-batch, no --schedule, and "
      "experts the GPU's grouped sm90 kernel stores, or hidden x ffn >= 2^21: there bf16 gradients take half the memory "
      "and the optimizer reads half the bytes; src/model/train_replica.hpp)");
  return [o, config, engine, dtype, chunk, samples, steps, file, min_lr, stop_after, f32_grads, sub] {
    if (!o->resume_dir.empty()) {
      // A save killed between its renames is completed first (with the log it was publishing, onto this --log only):
      // the settings below are read from its trainer_state.json.
      if (const std::string note = complete_interrupted_save(o->resume_dir, o->log_path); !note.empty())
        std::printf("%s\n", note.c_str());
      adopt_saved_settings(*o, *sub, kMaxSteps);
    }
    DMOE_REQUIRE_INPUT(stop_after->count() == 0 || o->stop_after >= 1, "train: --stop-after 0 is invalid: it stops "
                       "after a step of the --steps schedule, from 1 to --steps {} (leave it out to run all the steps)",
                       o->steps);
    // The help says "stop (and save)": without --save the stopped run was lost without a word (G14, sixteenth pass).
    if (stop_after->count() > 0 && o->save_dir.empty())
      std::printf("train: note: --stop-after %lld without --save: nothing is saved, so the stopped run cannot be "
                  "resumed (give --save DIR to continue it later with --resume DIR)\n", (long long)o->stop_after);
    DMOE_REQUIRE_INPUT(min_lr->count() == 0 || (o->min_lr >= 0 && std::isfinite(o->min_lr)),
                       "train: --min-lr {} is invalid: allowed a learning rate from 0 to --lr {} (leave it out for "
                       "the default, lr/10)", o->min_lr, o->lr);
    // The cosine that ends at --min-lr runs over the steps after the warm-up: with none, --min-lr was taken and had
    // no effect (`--steps 5 --min-lr 0` under the default --warmup 10 warmed up for all 5 steps).
    const bool has_cosine = o->warmup > 0 ? o->steps > o->warmup : o->steps > 1;
    DMOE_REQUIRE_INPUT(min_lr->count() == 0 || has_cosine || o->min_lr > o->lr,  // (the trainer refuses > --lr)
                       "train: --min-lr {} would have no effect: {}, so no step is on the cosine down to --min-lr; "
                       "{}, or leave out --min-lr", o->min_lr,
                       o->warmup > 0 ? fmt::format("--warmup {} covers all --steps {}", o->warmup, o->steps)
                                     : std::string("--steps 1 is the one step at the peak --lr"),
                       o->warmup > 0 ? fmt::format("give --warmup below --steps (e.g. --warmup {})", o->steps / 10)
                                     : std::string("give --steps 2 or more"));
    // A warm-up as long as the run: `--steps 2 --warmup 1000000` trained at lr 3e-09 and 6e-09 without a word (G20-14).
    // Said when --warmup is given (the default 10 over a short trial run is the usual case, and says nothing new).
    if (sub->count("--warmup") != 0 && o->warmup > 0 && o->warmup >= o->steps)
      std::printf("train: note: --warmup %lld >= --steps %lld: %s, and no step is on the cosine down to --min-lr "
                  "(give --warmup below --steps, e.g. --warmup %lld)\n", (long long)o->warmup, (long long)o->steps,
                  o->warmup > o->steps
                      ? fmt::format("the learning rate never reaches --lr {:g} (the last step's is {:.3g})", o->lr,
                                    o->lr * double(o->steps) / double(o->warmup)).c_str()
                      : "only the last step reaches --lr",
                  (long long)(o->steps / 10));
    // Options of one schedule given for another would be ignored: refused instead.
    for (const CLI::Option* opt : {samples, steps, file})
      DMOE_REQUIRE_INPUT(opt->count() == 0 || o->schedule == "tuned", "train: {} is an option of --schedule tuned "
                         "(this run: {}); drop it or add --schedule tuned", opt->get_name(),
                         o->schedule.empty() ? "no --schedule" : "--schedule " + o->schedule);
    DMOE_REQUIRE_INPUT(chunk->count() == 0 || o->schedule == "chunked-ar", "train: --chunk-bytes is the chunk of "
                       "--schedule chunked-ar (this run: {}; tuned chooses it)",
                       o->schedule.empty() ? "no --schedule" : "--schedule " + o->schedule);
    // --save-every saves into --save: without it the run saved nothing and said nothing (rc 0).
    DMOE_REQUIRE_INPUT(o->save_every == 0 || !o->save_dir.empty(), "train: --save-every {} saves a checkpoint into "
                       "--save, which is not given: add --save DIR, or drop --save-every", o->save_every);
    *engine = model_engine(*engine);
    DMOE_REQUIRE_INPUT(*dtype == "f32" || *dtype == "bf16", "--dtype '{}' is not allowed; allowed: f32, bf16", *dtype);
    o->engine = *engine;
    o->dtype = parse_dtype(*dtype);
    // Without effect elsewhere: the CPU engine and f32 models keep every gradient in f32.
    DMOE_REQUIRE_INPUT(f32_grads->count() == 0 || (o->engine == "cuda" && o->dtype == DType::bf16),
                       "train: --f32-expert-grads applies to --engine cuda --dtype bf16 (this run: --engine {} --dtype "
                       "{}, whose gradients are all f32 already); drop it", o->engine, *dtype);
    if (o->engine == "cpu")
      require_one_process("train", "train the whole model and write --log and --save (the runs' lines interleaved in "
                          "one log)", "use --engine cuda (one rank per process)");
    const std::string config_file = find_model_config_file(*config);
    check_train_paths(*o, config_file);
    const MixtralConfig c = load_mixtral_config(config_file);
    const TrainResult r = train_mixtral(c, *o);
    if (!r.records.empty())
      std::printf("done: step %lld loss %.4f val loss %.4f%s%s\n", (long long)r.records.back().step,
                  r.records.back().loss, r.final_val_loss, o->save_dir.empty() ? "" : " | saved ",
                  o->save_dir.c_str());
    return 0;
  };
}

}  // namespace dmoe::cli
